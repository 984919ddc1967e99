"""The package list, found rather than kept by hand: every folder under each root of the
package-dir mapping in pyproject.toml (``algorithms/`` installs as ``pbt.algorithms``, ...).
setuptools' own ``packages.find`` names a package by its folder, so it cannot map the roots.
Folders without ``__init__.py`` (the example manifests under ``configs/``) are listed too, as
setuptools wants for folders that hold package data."""

from setuptools import find_namespace_packages, setup
from setuptools.config.pyprojecttoml import load_file

ROOTS: dict[str, str] = load_file("pyproject.toml")["tool"]["setuptools"]["package-dir"]

setup(
    packages=[
        name
        for package, folder in ROOTS.items()
        for name in (
            package,
            *(
                f"{package}.{sub}"
                for sub in find_namespace_packages(folder, exclude=["*__pycache__"])
            ),
        )
    ]
)
