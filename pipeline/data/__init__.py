"""The stored dataset and what makes it: image sources, decoding, resize + crop, preprocessing."""
