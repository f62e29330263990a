"""Install entry for ringcore; metadata lives in pyproject.toml.

``bindings/`` and ``bench/`` stay top-level folders in the repository and are
installed as ``ringcore.bindings`` and ``ringcore.bench``.
"""

from setuptools import setup

setup(
    packages=[
        "ringcore",
        "ringcore.transport",
        "ringcore.algo",
        "ringcore.kernels",
        "ringcore.device",
        "ringcore.bindings",
        "ringcore.bench",
        "ringcore.bench.peers",
    ],
    package_dir={"ringcore.bindings": "bindings", "ringcore.bench": "bench"},
    package_data={"ringcore": ["py.typed"], "ringcore.kernels": ["cuda/*.cu"]},
)
