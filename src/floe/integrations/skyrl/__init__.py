"""floe under SkyRL 0.4.0's own trainer (extra ``floe-rl[skyrl]``; docs/integrations.md).

The switch is ``trainer.override_entrypoint=floe.integrations.skyrl.entrypoint`` on SkyRL's stock
``main_base`` command. ``mapping`` (SkyRL keys -> floe, pure) and ``py311`` (the Python 3.11 shim)
import without SkyRL; ``entrypoint``, ``dispatch`` and ``inference`` need it installed.
"""
