"""What the tests share: the CLI runner, PEFT-made adapters and models, kernel cases, a local hub
server, image editors and hostile inputs. Nothing here is a test."""
