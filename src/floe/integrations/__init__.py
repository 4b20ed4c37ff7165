"""Plugins that put a floe backend under other RL frameworks (verl, SkyRL), each an optional extra.

A plugin uses only floe's public client API (floe.connect, Client methods, floe.types) and
floe.convert; importing this package imports no framework.
"""
