"""The command line: the Typer app and its error mapping, argument parsing, one module per command
group, and the Rich views. The last stage."""
