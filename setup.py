"""Only the optional C extension; the project metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtune.ingest._flatscan",
            ["kvtune/ingest/_flatscan.c"],
            optional=True,  # without a C compiler the reader keeps its DuckDB path
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
        )
    ],
)
