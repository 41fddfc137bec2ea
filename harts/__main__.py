from harts.cli import app

app(prog_name="harts")
