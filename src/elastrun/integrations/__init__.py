"""Integrations of elastrun's training helpers with training frameworks
(imported only when used: each imports its framework)."""
