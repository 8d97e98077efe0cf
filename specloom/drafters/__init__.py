"""Drafters register themselves here by name (`@register("ngram")`); the engine looks them up, never branches
on the method name. The speculative core (propose -> verify -> commit) arrives with the drafters."""

from .base import DRAFTERS, register

__all__ = ["DRAFTERS", "register"]
