"""The routes of the API, one module per route family; a route module never imports another
(what two families share lives beside `app.py`, in `reads/` or in `streams/`)."""
