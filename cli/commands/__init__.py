"""The commands of `fedmq`, one module per command or command group; cli/app.py puts them together."""
