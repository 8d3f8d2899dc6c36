"""Workshop mode, for an instructor with a room of attendees (hub side): prepare a list of attendees ahead of time
(their image pulled, their container created, the workshop's notebooks copied into each home, each put in the
workshop's JupyterHub group, whose limits the site profile sets), see who runs what and how far (a JupyterHub
service for the instructor role), and clean up after (servers stopped, jobs ended, the group emptied)."""
