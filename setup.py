"""Which packages the wheel holds (the rest of the metadata is in pyproject.toml).

Every package under lmtier/ and connectors/ is found, so a new subpackage cannot be left
out; connectors/ (with its subpackages) is installed as lmtier.connectors.
scripts/check-wheel.sh (part of `make test`) checks the built wheel against the source
tree and starts `lmtier serve` from it.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["lmtier", "lmtier.*"]),
        "lmtier.connectors",
        *(f"lmtier.connectors.{name}" for name in find_packages("connectors")),
    ],
    package_dir={"lmtier.connectors": "connectors"},
)
