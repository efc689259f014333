"""sqlease's tables, at the schema version of the installed sqlease (see
``sqlease.contrib.django.schema``). A sqlease release that changes its schema adds a migration
here that runs the same function again."""

from django.db import migrations

from sqlease.contrib.django.schema import keep_schema, migrate_schema


class Migration(migrations.Migration):
    initial = True
    atomic = False  # sqlease migrates on its own connection (a SQLite write lock must be free)
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(migrate_schema, keep_schema, elidable=False)]
