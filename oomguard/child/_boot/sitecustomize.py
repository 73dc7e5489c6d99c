# oomguard's bootstrap. `oomguard run` puts this directory first on PYTHONPATH, so every Python process of the run
# (launcher workers included) executes it at start-up. It does nothing unless OOMGUARD_PLAN is set, and then only
# installs lazy import hooks. It runs the sitecustomize it shadows, if there is one.
import os
import sys


def _oomguard_bootstrap() -> None:
    try:
        from oomguard.child import bootstrap
    except ImportError:
        # A different interpreter than oomguard's own: load the package from where this file lives.
        import importlib.util

        pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        spec = importlib.util.spec_from_file_location(
            "oomguard", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"no oomguard package in {pkg}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["oomguard"] = mod
        spec.loader.exec_module(mod)
        from oomguard.child import bootstrap
    bootstrap.install()


def _chain_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


if os.environ.get("OOMGUARD_PLAN"):
    try:
        _oomguard_bootstrap()
    except Exception as e:  # never break the user's program
        sys.stderr.write(f"oomguard: bootstrap failed ({e.__class__.__name__}: {e}); running without it\n")
_chain_sitecustomize()
