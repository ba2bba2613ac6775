"""Pool images: the file format, its check, writing and reading, `verify` and `unpack`. Imports
pool/ and earlier stages."""
