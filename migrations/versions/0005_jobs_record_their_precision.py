"""jobs record the precision they trained in

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 18:20:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('precision_used', sa.String(length=8), nullable=True))
    op.add_column('jobs', sa.Column('precision_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('jobs', 'precision_reason')
    op.drop_column('jobs', 'precision_used')
