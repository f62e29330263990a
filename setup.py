"""Install entry for ringcore; metadata lives in pyproject.toml.

``bindings/torch``, ``bindings/jax``, ``bindings/ray`` and ``bench/`` stay
top-level folders in the repository and are installed as ``ringcore.torch``,
``ringcore.jax``, ``ringcore.ray`` and ``ringcore.bench``: users write
``import ringcore.torch as hvd``. Every package under ``ringcore/`` is found,
not listed, so a new one ships without a change here
(``tests/unit/test_packaging.py`` builds the wheel and checks).
"""

from setuptools import find_packages, setup

MAPPED = {
    "ringcore.torch": "bindings/torch",
    "ringcore.jax": "bindings/jax",
    "ringcore.ray": "bindings/ray",
    "ringcore.bench": "bench",
    "ringcore.bench.peers": "bench/peers",
}

setup(
    packages=[*find_packages(include=["ringcore", "ringcore.*"]), "ringcore.kernels.cuda", *MAPPED],
    package_dir=MAPPED,
    package_data={"ringcore": ["py.typed"], "ringcore.kernels.cuda": ["*.cu"]},
)
