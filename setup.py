"""Build hooks that pyproject.toml cannot express.

* conf/, recipes/ and templates/ live at the repository root (where users edit them) and are
  copied into the wheel as `pdtool/_data/...`, so an installed pdtool finds them too.
"""

from pathlib import Path
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
DATA_DIRS = ("conf", "recipes", "templates")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install reads them from the checkout
        target = Path(self.build_lib) / "pdtool" / "_data"
        for name in DATA_DIRS:
            shutil.copytree(ROOT / name, target / name, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
