"""Evaluation and reporting: methods side by side on a task, tables and pictures."""
