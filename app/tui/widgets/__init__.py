"""Widgets of the terminal UI: each one thing the screens are built from."""
