"""Scheduler policies: pure ordering logic that runs inside the SGLang scheduler (see plugin.py)."""

from __future__ import annotations

from policies.base import BeamTag, FcfsOrder, OrderingPolicy, decode_rid, encode_rid
from policies.prefix_order import PrefixAwareOrder
from sgl_tts.registry import Registry

POLICIES: Registry[type[OrderingPolicy]] = Registry("scheduler policy",
                                                    {cls.name: cls for cls in (FcfsOrder, PrefixAwareOrder)})


def make_policy(name: str) -> OrderingPolicy:
    """A fresh policy by name; an unknown name lists the known ones (KeyError)."""
    return POLICIES[name]()


__all__ = ["BeamTag", "FcfsOrder", "OrderingPolicy", "POLICIES", "PrefixAwareOrder", "decode_rid",
           "encode_rid", "make_policy"]
