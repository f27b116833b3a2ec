"""The workers' codec table, built from the protocol declarations (`schemas.protocols`): each
declaration names its codec by import path, resolved here once, at import."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

from schemas.protocols import PROTOCOLS, WireProtocol, declared
from worker.codecs.protocol import Codec

__all__ = ["CODECS", "PROTOCOLS", "CodecFactory", "codec_for", "resolve"]

CodecFactory = Callable[[], Codec]


def resolve(protocol: WireProtocol) -> CodecFactory:
    """The codec class a declaration names ("module:Class")."""
    module_name, _, attribute = protocol.codec.partition(":")
    factory: CodecFactory = getattr(importlib.import_module(module_name), attribute)
    return factory


CODECS: Mapping[str, CodecFactory] = MappingProxyType(
    {name: resolve(protocol) for name, protocol in PROTOCOLS.items()}
)


def codec_for(protocol_name: str) -> Codec:
    """A new codec speaking that protocol (KeyError naming the known ones otherwise)."""
    return CODECS[declared(protocol_name).name]()
