"""How a manifest is read: :mod:`.strict_yaml` parses a file within bounds, :mod:`.loader`
turns YAML or a dict (AgileRL's spellings included) into a validated
:class:`~pbt.config.manifest.Manifest`, :mod:`.overrides` applies the environment variables
that override machine settings, and :mod:`.canonical` writes the one layout that crosses
process boundaries and reads it back. Import the entry points from :mod:`pbt.config`.
"""
