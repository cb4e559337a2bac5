"""Build hooks that pyproject.toml cannot express.

* conf/, recipes/ and templates/ live at the repository root (where users edit them) and are
  copied into the wheel as `pdtool/_data/...`, so an installed pdtool finds them too.
* transfer._fabric (the libfabric binding, cffi API mode: transfer/csrc/*.c, declarations read
  from transfer/csrc/pd.h) is compiled only where libfabric's headers (`rdma/fabric.h`, Debian
  `libfabric-dev`) are found; without them pdtool still installs and `import transfer.fabric`
  says what is missing. Editable installs build it in place.
"""

import importlib.util
import shutil
from pathlib import Path

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


def fabric_cffi_modules() -> list[str]:
    path = ROOT / "transfer" / "_fabric_build.py"
    spec = importlib.util.spec_from_file_location("_fabric_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if build.find_header() is None:
        print("pdtool: rdma/fabric.h not found (Debian: apt-get install libfabric-dev); "
              "skipping the libfabric binding transfer._fabric")
        return []
    return ["transfer/_fabric_build.py:ffibuilder"]


setup(cmdclass={"build_py": BuildPyWithData}, cffi_modules=fabric_cffi_modules())
