"""`cchatq view`: a local web viewer of batches, sessions and program runs.

Layers, each a module of one job:

- `model`: the typed values every page and JSON twin is made of (RunRow, SessionRow,
  SessionView, TimelineStep, ...), with no I/O;
- `thread`, `timeline`, `rows`, `views`, `progress`: pure functions that build those values from
  a session's record, its trace events and a batch's members;
- `source`: the ViewSource protocol the app reads through, with two implementations:
  `fleet_source` (a live fleet's Redis, through producer.client.Client) and `file_source`
  (results files written by `cchatq submit --out`, no Redis);
- `app` (Starlette routes and Jinja templates, autoescaped), `auth` (the token rule), `serve`
  (uvicorn, the `cchatq view` command's body);
- `templates/` and `static/` (one stylesheet, one script: no build step, no CDN).

Starlette, Jinja2 and uvicorn are the optional extra `view`; only `app`, `auth` and `serve`
import them.
"""
