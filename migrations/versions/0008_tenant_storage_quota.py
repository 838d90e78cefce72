"""tenants have a storage quota in bytes

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 21:55:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        'tenants',
        sa.Column('max_storage_bytes', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    )


def downgrade() -> None:
    op.drop_column('tenants', 'max_storage_bytes')
