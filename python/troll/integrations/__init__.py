"""Adapters of troll for RL trainers (TRL: troll.integrations.trl)."""
