"""Install entry for ringcore; metadata lives in pyproject.toml.

``bindings/torch``, ``bindings/jax`` and ``bench/`` stay top-level folders in
the repository and are installed as ``ringcore.torch``, ``ringcore.jax`` and
``ringcore.bench``: users write ``import ringcore.torch as hvd``.
"""

from setuptools import setup

setup(
    packages=[
        "ringcore",
        "ringcore.transport",
        "ringcore.algo",
        "ringcore.kernels",
        "ringcore.device",
        "ringcore.torch",
        "ringcore.jax",
        "ringcore.ray",
        "ringcore.bench",
        "ringcore.bench.peers",
    ],
    package_dir={
        "ringcore.torch": "bindings/torch",
        "ringcore.jax": "bindings/jax",
        "ringcore.ray": "bindings/ray",
        "ringcore.bench": "bench",
    },
    package_data={"ringcore": ["py.typed"], "ringcore.kernels": ["cuda/*.cu"]},
)
