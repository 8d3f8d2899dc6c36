"""jupyter-hpcdl: interactive distributed deep learning on HPC clusters."""


def __getattr__(name: str):
    """``__version__``, read from the installed metadata only when asked (the package's command-line tools start
    often, in every container start: scanning the metadata there would cost each of them); ``report``, for a
    user's script to hand its figures to the session's live metrics (:func:`.figures.report`)."""
    if name == "report":
        from .figures import report

        return report
    if name != "__version__":
        raise AttributeError(f"module 'jupyter_hpcdl' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jupyter-hpcdl")  # one version: labextension/package.json, read at build time
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0+unknown"
