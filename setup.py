"""Only a build_py hook: install flexrollout-unsloth.pth at the top of site-packages.

The .pth line imports the tiny `_flexrollout_unsloth` hook module only when
UNSLOTH_FAST_INFERENCE=1 (see docs/unsloth.md). Everything else is in pyproject.toml.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "flexrollout-unsloth.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = self.build_lib
        if getattr(self, "editable_mode", False):
            # An editable wheel carries the non-editable files from the install directory
            # setuptools points at the unpacked wheel; build_lib is discarded there.
            target = self.get_finalized_command("install").install_lib
        self.copy_file(PTH, os.path.join(target, PTH), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithPth})
