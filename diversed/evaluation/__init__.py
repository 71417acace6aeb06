"""Evaluation and reporting: verifications side by side on a task, tables and pictures."""
