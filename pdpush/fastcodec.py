"""The protocol's fast path: msgspec types derived from its pydantic models (sans-I/O, no clock).

``protocol.py`` defines each message once, as a frozen pydantic model; that stays the one definition and the one
authority on what a message may be. Validating with pydantic costs a few microseconds warm, but 90-250 us on a
vCPU that has been idle for a few tens of milliseconds (BENCHMARKS.md, "Where an idle begin goes"), and a begin
decodes four messages. So this module derives from each model a ``msgspec.Struct`` with the same fields, the same
bounds (``ge``/``gt``/``le``/``lt``, lengths, literals, enums) and no extra fields, whose decoder validates in C.

- ``Codec.decode`` returns the pydantic message built from a frame the derived types accept, or None. None is not
  an answer: the caller then takes the authoritative path (msgpack, then pydantic), which gives the same message
  or the typed error. msgspec is stricter than pydantic's lax mode (it never coerces "5" to 5, 1.0 to 1 or 0 to
  False), so whatever it accepts pydantic accepts as the same message (tests/test_fastcodec.py checks that on
  mutated frames of every message); what it refuses costs one failed parse before the usual one.
- A model with validators of its own (``LayoutSpec``) is decoded as raw msgpack and validated by pydantic, once
  per distinct encoding (a Begin repeats its engine's layout every time).
- Fields named in ``pinned`` must be present and hold that value (``local_version``: a frame without it, or of
  another version, is refused by the authoritative path with ``IncompatiblePeer``, never defaulted here).
- ``Codec.encode`` writes a model's fields in their order, as ``msgpack.packb(model.model_dump())`` did, byte for
  byte, without building the dict; a ``sparse`` field that holds its given value is left out.
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import msgpack
import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo

_set = object.__setattr__  # pydantic's own way past a frozen model's __setattr__ (BaseModel.model_construct)
_SCALARS = (int, str, bytes, bool, float, type(None))
_BOUNDS = {at.Ge: "ge", at.Gt: "gt", at.Le: "le", at.Lt: "lt", at.MinLen: "min_length", at.MaxLen: "max_length"}


class Underivable(TypeError):
    """A model field whose type this module does not translate: that message always takes pydantic's path."""


def _meta(items) -> dict:
    out = {}
    for m in items:
        if isinstance(m, FieldInfo):
            out.update(_meta(m.metadata))
        elif type(m) in _BOUNDS:
            out[_BOUNDS[type(m)]] = getattr(m, _BOUNDS[type(m)])
        else:
            raise Underivable(f"constraint {m!r}")
    # msgspec's integer bounds are int64s; no msgpack integer reaches 2**64, so a bound there says nothing
    if out.get("lt", 0) >= 1 << 64:
        del out["lt"]
    if out.get("le", 0) >= (1 << 64) - 1:
        del out["le"]
    return out


def _has_validators(model: type[BaseModel]) -> bool:
    d = model.__pydantic_decorators__
    return bool(d.model_validators or d.field_validators or d.root_validators or d.validators)


_PLAIN_CONFIG = {"frozen", "extra", "strict", "title"}  # model_config keys the derived types reproduce (or ignore)


def _unmodelled(model: type[BaseModel]) -> str | None:
    """What of ``model`` the derived types would not reproduce, or None: config beyond ``_PLAIN_CONFIG`` (enum values,
    string transforms, inf/nan...), serializers, computed fields, aliases, excluded fields. Such a model keeps
    pydantic's path alone, for decoding and encoding."""
    extra = set(model.model_config) - _PLAIN_CONFIG
    d = model.__pydantic_decorators__
    if extra or d.field_serializers or d.model_serializers or d.computed_fields:
        return f"config {sorted(extra)} or serializers"
    for name, f in model.model_fields.items():
        if f.alias or f.validation_alias or f.serialization_alias or f.exclude or f.discriminator:
            return f"field {name}'s alias or exclusion"
    return None


class Codec:
    """Derives the types of ``models`` (each with a ``type`` literal, its tag) and decodes frames into them."""

    def __init__(self, models: list[type[BaseModel]], pinned: dict[str, Any], base: type[BaseModel],
                 sparse: dict[type[BaseModel], dict[str, Any]] | None = None):
        self._pinned = pinned
        self._base = base
        # fields left out of a message's encoding where they hold this value (decoding defaults them to it): a field
        # added to a message that peers of the version before read, and refuse as unknown, wherever it is not used
        self._sparse = sparse or {}
        self._structs: dict[type[BaseModel], type] = {}  # nested models with no validators
        # struct -> (its model, its tag, the fields to convert: (name, how, the model of a raw field))
        self._build: dict[type, tuple[type[BaseModel], str | None, tuple]] = {}
        tops = []
        self.skipped: dict[str, str] = {}  # message type -> why it takes pydantic's path alone
        for model in models:
            tag = typing.get_args(model.model_fields["type"].annotation)[0]
            try:
                tops.append(self._struct(model, tag))
            except Underivable as e:
                self.skipped[tag] = str(e)
        self._one = msgspec.msgpack.Decoder(Union[tuple(tops)]) if tops else None
        self._many = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._fields)

    # ---- deriving ----

    def _struct(self, model: type[BaseModel], tag: str | None) -> type:
        if _has_validators(model) or model.__private_attributes__ or model.__pydantic_post_init__:
            raise Underivable(f"{model.__name__} has validators or private attributes")
        if why := _unmodelled(model):
            raise Underivable(f"{model.__name__}: {why}")
        names = list(model.model_fields)
        if tag is not None and names[0] != "type":
            raise Underivable(f"{model.__name__}: its tag is not its first field")
        fields, convert = [], []
        for name, f in model.model_fields.items():
            if name == "type" and tag is not None:
                continue
            t = self._type(f.annotation, f.metadata, f"{model.__name__}.{name}")
            if t is msgspec.Raw:
                convert.append((name, "raw", f.annotation))
            elif t in self._build:
                convert.append((name, "struct", None))
            elif typing.get_origin(t) is list and typing.get_args(t)[0] in self._build:
                convert.append((name, "structs", None))
            if name in self._pinned:
                fields.append((name, Literal[self._pinned[name]]))
            elif f.is_required():
                fields.append((name, t))
            elif f.default_factory is None:
                fields.append((name, t, f.default))
            else:
                raise Underivable(f"{model.__name__}.{name} has a default factory")
        kw = dict(tag_field="type", tag=tag) if tag is not None else {}
        s = msgspec.defstruct(f"_{model.__name__}", fields, kw_only=True, forbid_unknown_fields=True, **kw)
        self._build[s] = (model, tag, tuple(convert))
        return s

    def _type(self, t, metadata, where: str, depth: int = 0):
        """The msgspec type of a field's type ``t`` (``depth`` 0) or of a type inside it. A nested model may be a
        field (its struct, or raw where it has validators) or a list's items (its struct): where ``_model`` looks."""
        meta = _meta(metadata)
        if typing.get_origin(t) is Annotated:
            inner, *extra = typing.get_args(t)
            return self._type(inner, [*metadata, *extra], where, depth)
        origin, args = typing.get_origin(t), typing.get_args(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            if meta or depth > 1 or (depth and _has_validators(t)) or _unmodelled(t):
                raise Underivable(f"{where}: a model where the fast path does not build one")
            if _has_validators(t):
                return msgspec.Raw
            if t not in self._structs:
                self._structs[t] = self._struct(t, None)
            return self._structs[t]
        inside = depth + 1 if origin is list and depth == 0 else 2
        if t in _SCALARS or origin is Literal or (isinstance(t, type) and issubclass(t, enum.Enum)):
            base = t
        elif origin is list:
            base = list[self._type(args[0], [], where, inside)]
        elif origin is tuple and args and args[-1] is not Ellipsis:
            base = tuple[tuple(self._type(a, [], where, inside) for a in args)]
        elif origin is dict:
            base = dict[self._type(args[0], [], where, inside), self._type(args[1], [], where, inside)]
        elif origin in (Union, types.UnionType):
            if meta:
                raise Underivable(f"{where}: bounds on a union")
            return Union[tuple(self._type(a, [], where, inside) for a in args)]
        else:
            raise Underivable(f"{where}: type {t!r}")
        return Annotated[base, msgspec.Meta(**meta)] if meta else base

    # ---- decoding ----

    def decode(self, frame) -> BaseModel | None:
        """The message in ``frame`` (one msgpack map), or None where the derived types refuse it."""
        if self._one is None:
            return None
        try:
            return self._model(self._one.decode(frame))
        except Exception:  # noqa: BLE001 - refused here (even RecursionError, on deep nesting): the authority judges it
            return None

    def entries(self, frame, most: int) -> list[msgspec.Raw] | None:
        """The entries of ``frame`` where it is a msgpack array of 2..``most`` well-formed objects, each undecoded;
        else None. The length is read from the array's header before anything is decoded."""
        head = frame[0] if len(frame) else 0
        if 0x90 <= head <= 0x9F:
            n = head & 0x0F
        elif head in (0xDC, 0xDD):  # array 16, array 32
            n = int.from_bytes(frame[1:3 if head == 0xDC else 5], "big")
        else:
            return None
        if not 1 < n <= most:
            return None
        try:
            return self._many.decode(frame)
        except Exception:  # noqa: BLE001 - as in decode
            return None

    def _model(self, s) -> BaseModel:
        """The pydantic model of a decoded struct, made as ``model_construct`` makes one (its fields, all set; no
        extra, no private attributes: ``_struct`` derives no model that has them), without its per-field Python:
        on a cold vCPU every line of Python costs a microsecond or more."""
        model, tag, convert = self._build[type(s)]  # (every field is in fields_set: pydantic's has those on the wire;
        # nothing in pdpush reads it)
        values = msgspec.structs.asdict(s)
        if tag is not None:
            values = {"type": tag, **values}
        for name, how, nested in convert:
            v = values[name]
            if how == "raw":
                raw = bytes(v)
                values[name] = _validated(nested, raw) if len(raw) <= MAX_CACHED else _validate(nested, raw)
            elif how == "struct":
                values[name] = self._model(v)
            else:
                values[name] = [self._model(x) for x in v]
        m = model.__new__(model)
        _set(m, "__dict__", values)
        _set(m, "__pydantic_fields_set__", set(values))
        _set(m, "__pydantic_extra__", None)
        _set(m, "__pydantic_private__", None)
        return m

    # ---- encoding ----

    def encode(self, msg: BaseModel) -> bytes:
        return self._encoder.encode(msg)

    def _fields(self, obj):
        """A model's fields, in order. One whose ``__dict__`` holds other keys (``model_copy(update=)`` takes any,
        unchecked) gives its ``model_dump``, as encoding did before: its fields alone."""
        if isinstance(obj, self._base):
            d = obj.__dict__
            if len(d) != len(type(obj).model_fields):
                d = obj.model_dump(mode="python")
            if (sparse := self._sparse.get(type(obj))) and any(d[k] == v for k, v in sparse.items()):
                d = {k: v for k, v in d.items() if k not in sparse or v != sparse[k]}
            return d
        raise NotImplementedError(f"not a protocol message: {type(obj).__name__}")


MAX_CACHED = 32 << 10  # a layout's encoding is at most ~20 KiB (4,096 windows); a longer one (padded with repeated
# keys) is validated each time, so that the cache holds at most 64 x 32 KiB whatever peers send


def _validate(model: type[BaseModel], raw: bytes) -> BaseModel:
    return model.model_validate(msgpack.unpackb(raw, raw=False, strict_map_key=True))


@functools.lru_cache(maxsize=64)
def _validated(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A nested model with validators, from its msgpack bytes: validated by pydantic once per distinct encoding (an
    exception is not cached). The messages that carry the same one share it: it is frozen, and nothing may change
    its lists in place (no code does)."""
    return _validate(model, raw)
