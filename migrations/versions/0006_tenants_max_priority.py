"""tenants have a maximum job priority

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 19:15:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('tenants', sa.Column('max_priority', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('tenants', 'max_priority')
