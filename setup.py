"""The one compiled part: kvpool.transfer._streamcopy (copies with streaming stores).

Everything else is in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), the install goes on and kvpool copies with memcpy instead
(kvpool.transfer.memcopy).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool.transfer._streamcopy", ["src/kvpool/transfer/_streamcopy.c"],
                             extra_compile_args=["-O2"], optional=True)])
