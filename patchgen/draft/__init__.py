"""`patchgen draft`: a spec written from the pinned upstream module, every patch a structure it recognised there.

A front end (patchgen/provenance.py FRONT_ENDS): it decides no byte of a generated file; it writes a spec, and the
usual generation then reads it. What it does not recognise it never guesses: it states it in `[model.unsupported]`
or refuses in one line.
"""
