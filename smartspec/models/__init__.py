from smartspec.models.registry import BUNDLED, ModelFetchError, fetch, resolve
from smartspec.models.loader import LoadedModel, load_model

__all__ = ["BUNDLED", "ModelFetchError", "fetch", "resolve", "LoadedModel", "load_model"]
