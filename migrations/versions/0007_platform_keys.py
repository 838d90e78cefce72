"""API keys are scoped: an admin key manages its own tenant, a platform key every tenant

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 21:20:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('api_keys', sa.Column('platform', sa.Boolean(), server_default=sa.false(), nullable=False))
    # Before this revision every admin key managed every tenant. The default tenant's admin keys (what
    # `ortune keys create --admin` made for the operator) keep that; other tenants' become tenant admins.
    op.execute("UPDATE api_keys SET platform = true WHERE admin = true AND tenant_id = 'default'")


def downgrade() -> None:
    op.drop_column('api_keys', 'platform')
