"""Files metrale reads and writes: the safetensors header, atomic outputs, JSON from untrusted
files, and hub ids. The first stage: it imports only the package's leaves."""
