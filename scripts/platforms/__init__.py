"""Render the team's values into the Anyscale and KubeRay files.

    make platforms                                   # platforms/values.yaml into platforms/
    make platforms VALUES=team.yaml OUT=~/ray-cv-platforms
    python -m scripts.platforms --values team.yaml --out DIR [key=value ...]

Sources: the values file (storage, registry, namespace, nodes, the configs the jobs run, the
team's package; platforms/values.yaml documents every key), runtime_env.yaml, the lock (the Ray
version and every pin, installed into the images) and configs/ through `pipeline.chain.plan` (the
entrypoints). The KubeRay files are checked as they are written, against KubeRay's CRDs, the
operator's own rules and Kubernetes' schemas: a value they refuse fails here, named.
tests/unit/test_platforms.py fails while the committed files differ from the rendering of
platforms/values.yaml.
"""
