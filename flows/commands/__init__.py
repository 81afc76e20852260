"""The `cpuforge` commands, one module per group; flows/cli.py maps each command name to its module's `add_*`."""
