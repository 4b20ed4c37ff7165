"""floe under verl 0.9.1 (`pip install floe-rl[verl]`): two Hydra keys switch a stock
`python -m verl.trainer.main_ppo` recipe to a floe backend.

    trainer.v1.trainer_mode=floe actor_rollout_ref.rollout.name=floe

The same `trainer.v1.trainer_mode=floe` runs verl's one-step off-policy entrypoint
(`python -m verl.experimental.one_step_off_policy.main_ppo`) on floe (`one_step`).
`plugin` registers the trainer and the rollout replica with verl (loaded by verl's
`verl.plugins` entry point, or VERL_USE_EXTERNAL_MODULES=floe.integrations.verl.plugin);
`loss_mapping` and `backend_config` turn verl's config into floe's (pure, no verl import).
Importing this package imports no verl. See docs/integrations.md.
"""
