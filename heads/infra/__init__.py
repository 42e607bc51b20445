"""Infrastructure under every verb: atomic files and free-space checks, the output guard, the strict YAML
reader, typed settings, the device decision."""
