"""Build the optional C extension; all other metadata lives in pyproject.toml.

``optional=True``: on a machine without a C compiler (or, for the JPEG one, without
libjpeg's headers) the install still succeeds and headrace uses its pure-Python format
code and simplejpeg (same results within stated tolerances, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "headrace.io._hrio",
            sources=["src/headrace/io/_ext/hrio.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        # the windowed JPEG decode + resample of headrace.image (links the system's
        # libjpeg-turbo: apt's libjpeg-dev / libjpeg62-turbo-dev, which scripts/_venv.sh
        # installs); without it headrace.image decodes whole images through simplejpeg
        Extension(
            "headrace.image._jpeg",
            sources=["src/headrace/image/_ext/jpeg.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
