"""patchgen: declarative patch specs + jinja2 templates + a libcst rewriter -> checked-in modeling files."""

__version__ = "0.1.0"
