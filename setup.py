"""Which packages the wheel holds (the rest of the metadata is in pyproject.toml).

Every package under lmtier/ and connectors/ is found, so a new subpackage cannot be left
out; connectors/ (with its subpackages) is installed as lmtier.connectors.
scripts/check-wheel.sh (part of `make test`) checks the built wheel against the source
tree, both ways, and starts `lmtier serve` from it.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class FreshBuild(build_py):
    """A build that starts from no lmtier in ``build/lib``: setuptools copies the sources
    over what an earlier build left there, so a module moved or removed since (an old
    name that is now a warned alias) would ship in the wheel and shadow its alias."""

    def run(self) -> None:
        shutil.rmtree(Path(self.build_lib) / "lmtier", ignore_errors=True)
        super().run()


setup(
    packages=[
        *find_packages(include=["lmtier", "lmtier.*"]),
        "lmtier.connectors",
        *(f"lmtier.connectors.{name}" for name in find_packages("connectors")),
    ],
    package_dir={"lmtier.connectors": "connectors"},
    cmdclass={"build_py": FreshBuild},
)
