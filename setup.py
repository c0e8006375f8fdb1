"""Build the optional C extension; all other metadata lives in pyproject.toml.

``optional=True``: on a machine without a C compiler the install still succeeds and
headrace uses its pure-Python format code (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "headrace.io._hrio",
            sources=["src/headrace/io/_ext/hrio.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
