"""The web console: server-rendered pages over the control methods, served by the daemon.

Every action a page offers is a control method dispatched in-process (with its
validation and errors); the console adds no behaviour of its own. Rooms:
``auth`` (the token, the cookie, CSRF and Host checks), ``http`` (requests,
responses, security headers), ``app`` (routing), ``views/`` (one module per
screen), ``charts`` (SVG drawn here), ``live`` (server-sent events),
``server`` (the thread-pool HTTP server's lifecycle). See docs/console.md.
"""
