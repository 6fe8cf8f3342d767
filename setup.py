"""Maps the top-level folders (builders/, runtime/, kernels/) into the one import namespace `primebuild`.

pyproject.toml holds all metadata; this file only computes the package list, which static
configuration cannot do for remapped folders.
"""

from setuptools import find_packages, setup

MAPPED = ("builders", "runtime", "kernels")

packages = ["primebuild"] + [f"primebuild.{p}" for p in find_packages(where="primebuild")]
package_dir = {"primebuild": "primebuild"}
for top in MAPPED:
    package_dir[f"primebuild.{top}"] = top
    packages += [f"primebuild.{top}"] + [f"primebuild.{top}.{p}" for p in find_packages(where=top)]

setup(packages=packages, package_dir=package_dir,
      package_data={"primebuild": ["py.typed"], "primebuild.builders": ["templates/*.j2"]})
