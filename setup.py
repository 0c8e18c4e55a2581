"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

Every package under modelopt_k3/ is found; modelopt_k3.recipes (the top-level recipes/ directory,
data only) is added by name because pyproject's ``packages.find`` cannot be combined with a mapped
package that has no directory under modelopt_k3/.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["modelopt_k3", "modelopt_k3.*"]), "modelopt_k3.recipes"])
