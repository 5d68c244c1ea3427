"""The base of the input shapes a caller builds by hand (``Anchor``, ``AppendItem``, ``StoreConfig``, ...).

Calling one of these classes with a bad value raises ``InvalidInput`` (a ``ValueError``), as every other
refusal of this library does, instead of pydantic's ``ValidationError``. Only the call is translated (in
the metaclass): pydantic's own ``model_validate`` / ``model_validate_json`` keep raising
``ValidationError``, as pydantic documents them, and a shape nested in another validates as before. A
custom ``__init__`` would have translated the call too, but pydantic then runs ``__init__`` inside
``model_validate`` as well, where the ``ValueError`` came back wrapped in a ``ValidationError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .errors import InvalidInput
from .terminal import quoted

if TYPE_CHECKING:  # the type checker sees pydantic's metaclass by its (private) name
    from pydantic._internal._model_construction import ModelMetaclass as _PydanticMeta
else:  # at run time, without importing pydantic's private module
    _PydanticMeta = type(BaseModel)


def refusal(what: str, error: ValidationError) -> str:
    """One line for a refused shape: its first error's location and message."""
    first = error.errors(include_url=False, include_context=False, include_input=False)[0]
    # A field's name as it is; an unknown key a caller made up quoted (control characters, surrogates).
    where = ".".join(str(p) if isinstance(p, int) or str(p).isidentifier() else quoted(p) for p in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"invalid {what}{': ' + where if where else ''}: {message}"


class _RefusingMeta(_PydanticMeta):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as e:
            raise InvalidInput(refusal(cls.__name__, e)) from None


class Shape(BaseModel, metaclass=_RefusingMeta):
    """A pydantic model whose constructor refuses a bad value with ``InvalidInput``."""
