"""The library the Ray cluster runs behind jobs/: one package a wing, over a small core.

Its layout, wing by wing and module by module, and the rules on what imports what:
docs/layout.md.
"""
