from smartspec.models.loader import LoadedModel, load_model
from smartspec.models.registry import BUNDLED, ModelFetchError, fetch, resolve

__all__ = ["BUNDLED", "ModelFetchError", "fetch", "resolve", "LoadedModel", "load_model"]
