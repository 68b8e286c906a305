"""Screens of the terminal UI: the setup wizard, chat, models, plan, hardware, and dialogs."""
