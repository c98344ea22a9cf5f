"""The subcommands of ``cmdbus-trio`` other than ``serve``: each module adds its parser
and runs it (docs/clients.md, "Command line")."""
