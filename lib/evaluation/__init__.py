"""Evaluation: the downstream tasks (downstream.py) and how runs are labelled and ordered wherever
they are shown together (runs.py)."""
